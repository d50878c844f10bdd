from tunebench.cli import main

raise SystemExit(main())
