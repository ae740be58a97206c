"""The one base model and its adapter views: loading, adapter folders, quantization, model families, packing,
log-probs, generation and the memory card."""
