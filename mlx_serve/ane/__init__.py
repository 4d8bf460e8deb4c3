"""The ANE lane: prefill chunks of dense models run as a Core ML program on Apple's Neural Engine.

- `spec.py`        what the builder reads from a loaded mlx-lm model (refuses what it cannot build)
- `contract.py`    the program's inputs/outputs and the host arrays that feed it
- `mil_layers.py`  the decoder block as MIL ops (fp16, channels-first, 1x1 convs)
- `builder.py`     one function per chunk size -> one multifunction `.mlpackage`
- `interpreter.py` a NumPy interpreter of the saved package, to check its numerics on Linux
- `host.py`        MLX-side embedding, RoPE tables and LM head
- `lane.py`        the `PrefillLane` contract the runner calls, with `CoreMLLane` (macOS) and the
                   labelled `MlxCpuStandInLane` (anywhere)
- `cache.py`       packages cached by model fingerprint

Nothing here is imported by the engine unless `--ane-lane` is not `off`; importing this package never
touches Core ML's runtime, so it is safe on Linux.
"""
