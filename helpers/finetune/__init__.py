"""Fine-tuning a model bigger than one card: LoRA/QLoRA adapters, quantized frozen bases, and the training-memory planner."""
