/* Assembly with -g: a unit in DW_LANG_Mips_Assembler with a line program.
   asm_entry is a label only (no .type): no DWARF subprogram covers it, as
   none covers a kernel's entry_SYSCALL_64_after_hwframe; asm_typed is a
   function, which the assembler gives a subprogram. */
	.text
	.globl	asm_entry
asm_entry:
	movl	%edi, %eax
	addl	%esi, %eax

	nop
	ret
	.globl	asm_typed
	.type	asm_typed, @function
asm_typed:
	leal	(%rdi,%rsi), %eax
	ret
	.size	asm_typed, .-asm_typed
	.section .note.GNU-stack,"",@progbits
