"""Demo: a tiny MoE GPT trained on CPU with the Foreshock client (see README.md)."""
