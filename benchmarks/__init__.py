"""torchqkit's benchmarks: one runner, `python -m benchmarks <group>`, each group a module of this package over the
shared helpers in benchmarks/common; results as JSON lines in benchmarks/results/<group>.jsonl, then
`python -m benchmarks plot` and `python -m benchmarks report`."""
