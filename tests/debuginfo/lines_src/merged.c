/* Functions gcc merges (-fipa-icf, on at -O2) while each keeps an address of
 * its own, taken in the_ops: the bodies of noop_b and noop_c are copies,
 * and their subprograms in the DWARF have no address.  stub is assembly
 * in a C unit: no line in the unit's program covers it. */
struct ops {
	void (*a)(int);
	void (*b)(int);
	void (*c)(int);
	int (*d)(void);
};

static void noop_a(int v) { }
static void noop_b(int v) { }
static void noop_c(int v) { }
static int ret_zero(void) { return 0; }

struct ops the_ops = { noop_a, noop_b, noop_c, ret_zero };

asm(".text\n.globl stub\n.type stub, @function\nstub:\n\tnop\n\tret\n.size stub, .-stub\n");

int main(void)
{
	the_ops.a(1);
	return the_ops.d();
}
