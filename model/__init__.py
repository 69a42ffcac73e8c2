"""The model layer, shared by the rollout pool and the trainer: the tiny Qwen3-VL built from a config
with a tokenizer trained here (`model.tiny_vlm`), the prompt format (`model.prompt`) and the inputs and
behaviour distribution every log-prob is computed with (`model.inputs`)."""
