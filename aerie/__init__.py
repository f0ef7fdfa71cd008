"""The ``aerie`` command line of the embedded default (:mod:`aerie.cli`): the application on
top of Aerie's Dagster definitions. It ticks the sensors and executes the runs they request
in its own process (:mod:`aerie.demo`, :mod:`aerie.launch`) and prints what serves
(:mod:`aerie.status`).

Invariant: nothing imports this package but tests and benchmarks; it reaches the definitions
only by loading the code location's module by name (:func:`aerie.launch.definitions`), as
Dagster does, never by importing ``definitions``.
"""
