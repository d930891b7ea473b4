import sys

from sprpo_lib.train.trainer import main

sys.exit(main())
