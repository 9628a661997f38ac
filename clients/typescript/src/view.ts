// The subscriber's side of the version logic, as greendot_core::View:
// snapshots and pushes may arrive in any order (answers and pushes travel
// apart, a resumed session gets fresh snapshots); only a strictly newer
// version replaces what is known, so a target's version never goes back.

import type { Presence } from "./types.js";

/** What `View.apply` did with an update. */
export type Applied = "new" | "updated" | "dropped";

export class View {
  private readonly known = new Map<string, Presence>();

  /** Applies a snapshot or a push for `target`. */
  apply(target: string, presence: Presence): Applied {
    const known = this.known.get(target);
    if (known === undefined) {
      this.known.set(target, presence);
      return "new";
    }
    if (presence.version > known.version) {
      this.known.set(target, presence);
      return "updated";
    }
    return "dropped";
  }

  get(target: string): Presence | undefined {
    return this.known.get(target);
  }

  /** Forgets a target (after unsubscribing). */
  forget(target: string): Presence | undefined {
    const known = this.known.get(target);
    this.known.delete(target);
    return known;
  }

  /** Forgets everything (a session that was not resumed: versions may begin again). */
  clear(): void {
    this.known.clear();
  }

  entries(): IterableIterator<[string, Presence]> {
    return this.known.entries();
  }

  get size(): number {
    return this.known.size;
  }
}
