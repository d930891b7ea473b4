"""The policy model: loading (embedded default, local or hub checkpoints, tiny test
models), its layers, and LoRA."""
