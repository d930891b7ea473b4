from sprpo_lib.bench.suite import main

raise SystemExit(main())
