"""compatlas: an atlas of attention-head composition across pretrained transformers."""

__version__ = "0.1.0"
