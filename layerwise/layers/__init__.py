"""Building blocks of the models: linear (plain and fused), embedding, norm, rotary, attention."""
