// Why a client call failed (the Rust client's ClientError, one class each).

import { retryHint } from "./backoff.js";
import { closeCodeName, errorCodeName, type WireError } from "./types.js";

export abstract class GreendotError extends Error {}

/** A bad client setting, or a request larger than the server's frame cap. */
export class ConfigError extends GreendotError {
  override name = "ConfigError";
}

/** No connection could be opened (no binding's handshake completed in time). */
export class ConnectError extends GreendotError {
  override name = "ConnectError";
}

/** The server closed with a close code (and perhaps an error frame before it). */
export class RejectedError extends GreendotError {
  override name = "RejectedError";
  constructor(
    /** The greendot close code, or null if the connection ended without one. */
    readonly closeCode: number | null,
    /** The server's error frame, or the close reason as an error. */
    readonly error: WireError,
  ) {
    super(`refused by the server (${closeCode === null ? "no close code" : closeCodeName(closeCode)}): ${errorCodeName(error.code)}: ${error.message}`);
  }

  /** The server's `retry_ms`, if its error or close reason had one. */
  get retryAfterMs(): number | null {
    return retryHint(this.error.message);
  }
}

/** The connection was lost (no close code from the server). */
export class LostError extends GreendotError {
  override name = "LostError";
}

/** The server answered the request with an error. */
export class ServerError extends GreendotError {
  override name = "ServerError";
  constructor(readonly error: WireError) {
    super(`server error ${errorCodeName(error.code)} (${error.code}): ${error.message}`);
  }
}

/** The server broke the protocol (an undecodable frame, an answer of the wrong kind). */
export class ProtocolError extends GreendotError {
  override name = "ProtocolError";
}

/**
 * No answer in time. A request never sent (the client was reconnecting) is
 * dropped and never takes effect; one already sent may or may not have.
 */
export class TimeoutError extends GreendotError {
  override name = "TimeoutError";
}

/** The client is closed. */
export class ClosedError extends GreendotError {
  override name = "ClosedError";
}
