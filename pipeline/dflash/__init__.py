"""DFlash: a block drafter fed by several target layers, proposing a whole block in one pass
(see :mod:`pipeline.dflash.model`)."""
