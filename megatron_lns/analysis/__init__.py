"""Curse-of-depth diagnostics: of model chunks (:mod:`.depth`, :mod:`.plots`) and of
trained runs, checkpoints and Hugging Face exports (:mod:`.trained_models`)."""
