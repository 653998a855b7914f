"""Recipe fragments the multi-process tests of the tiny model share (TOML text)."""

#: 2 groups of 4 candidates, 2 updates of micro-batches of 2, fp32 end to end (exact on CPU)
TINY_GEOMETRY = """
rollout-batch-size = 2
n-samples-per-prompt = 4
micro-batch-size = 2
num-updates-per-batch = 2
fsdp-param-dtype = "fp32"
fsdp-reduce-dtype = "fp32"
weight-sync-wire-dtype = "fp32"
"""

#: 32x32, 4 steps, SDE steps 1 and 2 trained; a TOML table, so it goes last in a recipe
TINY_SAMPLING = """
[sampling-config]
height = 32
width = 32
num_inference_steps = 4
eta = 1.0
sde_type = "sde"
sde_indices = [1, 2]
"""


def tiny_recipe(model_dir, prompt_data, *, ranks: int = 1, extra: str = "") -> str:
    """A whole t2i recipe of the tiny model: TINY_GEOMETRY and TINY_SAMPLING, `ranks` processes;
    `extra`: more top-level keys, the reward's among them (none of the keys written here: TOML
    refuses a key twice)."""
    return f"""
actor-num-nodes = 1
actor-num-gpus-per-node = {ranks}
generation-task = "t2i"
model-path = "{model_dir}"
prompt-data = "{prompt_data}"
{TINY_GEOMETRY}
eps-clip = 1e-3
lr = 1e-3
{extra}
{TINY_SAMPLING}"""
