from sprpo_lib.evaluate.cli import main

raise SystemExit(main())
