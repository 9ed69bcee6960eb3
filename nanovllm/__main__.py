from nanovllm.cli import main
import sys
sys.exit(main())
