"""`python -m sonar_fx ...`: the same command line as the `sonar-fx` console script."""

from sonar_fx.cli import main

raise SystemExit(main())
