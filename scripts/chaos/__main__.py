"""`python scripts/chaos [--seeds 1,2,3] [--modes separate,rl] [--quick]`: see ``chaos.cli``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # scripts/: the package `chaos`

from chaos.cli import main  # noqa: E402

raise SystemExit(main())
