"""The ANE lane: prefill chunks of dense models run as a Core ML program on Apple's Neural Engine.

- `spec.py`        what the builder reads from a loaded mlx-lm model (refuses what it cannot build)
- `contract.py`    the program's inputs/outputs and the host arrays that feed it
- `mil_layers.py`  the decoder block as MIL ops (fp16, channels-first, 1x1 convs)
- `builder.py`     one function per chunk size -> one multifunction `.mlpackage`
- `interpreter.py` a NumPy interpreter of the saved package, to check its numerics on Linux
- `host.py`        MLX-side embedding, RoPE tables and LM head
- `lane.py`        the `PrefillLane` contract the runner calls, with `CoreMLLane` (macOS) and the
                   labelled `MlxCpuStandInLane` (anywhere)
- `pieces.py`      one chunk of any length through the package's fixed sizes, KV carried between calls
- `handoff.py`     the runner's calls: past K/V out of the engine's KV pool, new K/V back in
- `check.py`       interpreter vs the model's MLX layers (`python -m mlx_serve ane check`)
- `cache.py`       packages cached by model fingerprint (`python -m mlx_serve ane build`)

Choices: KV is explicit input/output (not Core ML state) because the engine's paged KV pool must own it for
GPU decode; the cost is copying the padded past per call (state per request slot is the next step). The
program ends after the final RMSNorm, so the host applies only the LM head.

Nothing here is needed by the engine unless `--ane-lane` is not `off`; importing any module here never
touches Core ML's runtime, so it is safe on Linux.
"""
