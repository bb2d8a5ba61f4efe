"""The Kimi-K3-style decode model (needs torch: ``pip install 'kimi-perf[model]'``).

``config`` (no torch) holds the presets; ``weights`` draws or loads a checkpoint; ``model`` is
the standard decode path; ``reference`` the float64 math it is checked against; ``harness``
runs prompt + decode steps with per-step and per-layer ranges; ``tp`` runs ranks with
torch.distributed; ``validate`` drives ``kimi-perf validate``.
"""
