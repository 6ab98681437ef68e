// SPDX-License-Identifier: GPL-2.0
/*
 * A module whose init runs about 2 s in its own code (a loop on jiffies in
 * .init.text), for tests/vm/test_modevents_vm.py: samples a per-task perf
 * recording of insmod takes during init land in this module's init text,
 * which is freed once init returns.
 */
#include <linux/init.h>
#include <linux/jiffies.h>
#include <linux/module.h>

static unsigned long slowinit_spins;

/*
 * Core text, as every real module has: what a profiler maps the module by.
 * Exported, so that gcc cannot see every caller is cold and move it to
 * .text.unlikely.
 */
noinline unsigned long slowinit_count(void)
{
	return READ_ONCE(slowinit_spins);
}
EXPORT_SYMBOL_GPL(slowinit_count);

static int __init slowinit_init(void)
{
	unsigned long end = jiffies + 2 * HZ;

	while (time_before(READ_ONCE(jiffies), end)) {
		slowinit_spins++;
		cpu_relax();
	}
	pr_info("slowinit: %lu spins\n", slowinit_spins);
	return 0;
}

static void __exit slowinit_exit(void)
{
	pr_info("slowinit: %lu spins at exit\n", slowinit_count());
}

module_init(slowinit_init);
module_exit(slowinit_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("init that runs 2 s in its own code (kreld's VM tests)");
