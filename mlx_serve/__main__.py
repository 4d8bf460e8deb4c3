import sys

from mlx_serve.cli import main

sys.exit(main())
