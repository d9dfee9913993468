from primerl.cli.main import main

raise SystemExit(main())
