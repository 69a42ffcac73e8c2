"""The model layer, shared by the rollout pool and the trainer: the policy on disk, any Qwen3-VL
directory (`model.hf_io`), the architectures a fresh one is built from, the tiny one among them
(`model.architectures`), the tokenizer trained here (`model.tokenizer`), the prompt format
(`model.prompt`), and the inputs and behaviour distribution every log-prob is computed with
(`model.inputs`)."""
