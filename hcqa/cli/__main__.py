"""``python -m hcqa.cli``: the same as the ``hcqa`` command."""

import sys

from hcqa.cli import main

sys.exit(main())
