"""Shared pytest set-up. It lives at the repository root so that pytest puts the root on sys.path
and `import profiler` / `import solver` find the packages, not the test folders of the same names."""
import os

# Tests run many small torch ops on 2 cores: one intra-op thread avoids oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
