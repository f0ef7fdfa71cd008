"""The names of the dump readers (light: what configuration validates against without
loading the readers)."""

FRAMEWORKS = ("nemo-rl", "slime", "trl-text", "verl-text")
