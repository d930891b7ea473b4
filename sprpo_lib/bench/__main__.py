from sprpo_lib.bench.cli import main

raise SystemExit(main())
