"""More than one machine (SPEC §19): other corrallm nodes as further backends of a model."""
