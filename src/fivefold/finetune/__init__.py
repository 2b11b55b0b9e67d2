"""Parameter-efficient fine-tuning: LoRA and QLoRA adapters (a model transformation, like the
parallel ones) and PEFT adapter directories in and out. See docs/lora.md."""
