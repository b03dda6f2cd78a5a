"""Read-only tools over a checkpoint root: status, inspect, export, compare, the drill, lineage,
doctor, the timeline plot. They never change what a running job depends on."""
