"""Web task families on a local site: the shop (shop.py), its tasks and end-state checks (shop_tasks.py)."""
