"""Random-weight checkpoints of real shapes, written offline: the presets, their tokenizer and chat template.

`python -m app.checkpoints.model_builder PRESET DIR` writes one; `resolve_model` turns a preset name
in a config into a folder on first use.
"""
