"""optkit: checkpoint -> calibrate -> quantize -> export a verified artifact."""

__version__ = "0.1.0"

#: Version of the artifact layout written by :mod:`optkit.export` (``optkit.json``).
ARTIFACT_FORMAT_VERSION = 1
