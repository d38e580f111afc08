"""Fine-tuning a model bigger than one card: LoRA/QLoRA adapters, quantized frozen bases, and the training-memory planner."""
import logging

# peft imports bitsandbytes, whose CPU backend, on CPUs with AVX512-BF16, tries to fetch a 4-bit matmul kernel from a
# model hub and warns when it cannot. The course's 4-bit base is torchao's NF4 (helpers.finetune.quant) and fetches
# nothing: that warning is noise here.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
