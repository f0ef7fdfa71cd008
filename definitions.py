from dagster import Definitions
defs = Definitions()
