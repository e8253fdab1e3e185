"""The ``lpo-compare`` console script (``python -m openrlhf_lpo.cli.compare``): :mod:`openrlhf_lpo.compare.cli`
with the CPU presets the demo registers (``openrlhf_lpo/demo/study.py``; the compare room never imports the demo).
"""

import warnings

# torch.cuda imports the deprecated pynvml package on import; nothing the user can act on (as lpo-demo)
warnings.filterwarnings("ignore", message=".*pynvml.*")

from openrlhf_lpo.demo import study  # noqa: F401,E402  (registers --preset cpu-demo and ci)
from openrlhf_lpo.compare.cli import main, run  # noqa: F401,E402

if __name__ == "__main__":
    main()
