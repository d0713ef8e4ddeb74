"""Pure functions of per-rank payloads (``Mapping[int, Record]``); no torch.distributed,
no ipyparallel, no notebook libraries. Tested without a cluster."""
