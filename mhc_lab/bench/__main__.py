import sys

from mhc_lab.bench import main

sys.exit(main())
