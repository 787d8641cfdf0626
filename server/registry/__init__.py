"""The encoder registry: the façade the routes call, its records and journal, the loaded-encoder cache, intake, the guard scheduler."""
