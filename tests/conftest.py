import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
