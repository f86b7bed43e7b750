"""The measurements of ``benchmarks/control_plane.py``, one module each (its docstring says what each
field means)."""
