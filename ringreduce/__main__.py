"""``python -m ringreduce``: the ``ringrun`` launcher without the console script."""

import sys

from ringreduce.launcher import main

sys.exit(main())
