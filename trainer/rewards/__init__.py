"""Rewards for generative RL: scorers, where they run, and group-normalised advantages.

Modules (import what you need; this package imports nothing heavy on its own):
  base          the GenerativeRewardScorer protocol, ImageBatch (the one image conversion),
                FunctionScorer (a plain function as a scorer), scorer loading by dotpath,
                SHIPPED_SCORERS
  pickscore     PickScoreScorer            component "pickscore"
  clipscore     ClipScoreScorer            component "clipscore"
  aesthetic     AestheticScorer            component "aesthetic"
  hpsv2         Hpsv21Scorer               component "hpsv21"
  clip          what the CLIP-family scorers share (directory checks, ClipEmbedder)
  vlm_judge     VlmJudgeScorer             component "vlm_judge" (an OpenAI-compatible chat endpoint)
  ocr           OcrScorer                  component "ocr"
  jpeg          JpegCompressibilityScorer  "jpeg_compressibility";
                JpegIncompressibilityScorer "jpeg_incompressibility"
  color         ColorScorer                component "color"; color_palette(), color_prompts()
  video         VideoBatch and the video scorers (required_tracks ("video",)): FramewiseScorer (any image
                scorer on sampled frames, mean / min), VideoOcrScorer "video_ocr",
                TemporalConsistencyScorer "temporal_consistency", VideoJudgeScorer "video_vlm_judge"
  remote        the HTTP JSON protocol (images, or videos as PNG frames) and RemoteScorer (--reward-runtime remote)
  transport     one bounded HTTP exchange with a reward peer (deadline, size cap, no redirects, token)
  manager       RewardManager / reward_manager_from_config: runtimes cpu / colocate / remote, batching
  post_process  post_process / compute_advantages / gather_scores -> RewardResult (reward/* metrics)
  watch         the reward-hacking watch: image statistics, held-out scores, the suspect rule
"""
