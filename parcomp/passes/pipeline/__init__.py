"""Pipeline parallelism: stage splitting, per-stage programs, schedules and their simulator."""
