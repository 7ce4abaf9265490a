"""The GPU check of issue 14 (``python -m bench.gpu``, ``__main__``; docs/gpu.md): a harness
(``harness``), one module a part (``shared``, ``reform``, ``speed``, ``nccl2``, ``amp``; the
MLP job parts a, b and d share is ``mlp``), the scripts their jobs run (``scripts/``) and
the step hooks their workers import (``hooks/``)."""
