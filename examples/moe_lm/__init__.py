"""The pieces of examples/train_moe_lm.py: data, model, training loop."""
