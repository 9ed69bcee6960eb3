import sys

from nanovllm.cli import main

sys.exit(main())
