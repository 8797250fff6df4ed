import os

# Tests run many small torch ops on 2 cores: one intra-op thread avoids oversubscription.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
