"""Small torch functions shared by runtime roles that may not import each other (the engine
samples with them, the trainer recomputes with them: DESIGN.md forbids engine <-> train
imports, and one definition keeps the two bit-for-bit equal)."""
